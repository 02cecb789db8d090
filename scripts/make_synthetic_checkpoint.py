"""Write a random DeepSeek-V3-shaped checkpoint: config.json, sharded safetensors + index, tokenizer.json.

    python scripts/make_synthetic_checkpoint.py OUT [--layers 8] [--hidden 1024] [--shards 4] [--dtype fp8]

The writer is `mlaquant.modeling.synthetic` (its docstring: shapes, weights, dtypes), so that an installed
`mlaquant bench gpu` has it too; this script keeps the command line.
"""

from mlaquant.modeling.synthetic import main

if __name__ == "__main__":
    main()
