"""The mlx-lm adapter: ``engine`` loads a model (``gguf`` for a GGUF file); ``caches`` maps
policies to mlx-lm's own cache classes; ``stream`` feeds them; ``attention`` reads the softmax
its layers compute; ``kv_size`` predicts the KV bytes they hold (no mlx import).

Importing this package imports no engine; import the module you need.
"""
