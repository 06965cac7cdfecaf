"""The llama.cpp adapter (llama-cpp-python): ``engine`` loads a model; ``stream``,
``prefix_cache`` and ``group`` run policies on its contexts (``context``); ``attention`` reads its
softmax tensors; ``kv_size`` predicts the KV bytes it holds (no llama.cpp import).

Importing this package imports no engine; import the module you need.
"""
