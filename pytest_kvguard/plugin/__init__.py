"""The pytest glue: the plugin's hooks (``hooks``, the pytest11 entry point), its options,
the budgets-file items, the ``kvguard`` fixture, what they share (``session``) and the end of
the session (``reporter``: tables, JSON, plots, step summary)."""
