"""The base every layer uses: the config loader and its one-line errors (`configure`), file
hashing (`hashing`), the directory lock (`lock`), the CPU type's key (`machine`). It imports
nothing of the project: `pipeline/` (data) and `model/` sit on it, `launch/` on all three
(tests/test_layers.py)."""
