"""The prepare side of the data pipeline: raw text to a tokenizer and WebDataset shards, with Ray.

`job` runs it (plan -> scan -> tokenizer -> encode -> publish), after `checks`; `sources` and
`readers` (with `manpage`) read the inputs; `scan` and `encode` are what one Ray task does, as
pure functions; `ray_runner`, the only module that imports Ray, runs them; `train_tokenizer`
trains SentencePiece; `report` makes the manifest's statistics and the summary. What it
writes is `pipeline.format`'s contract; it never imports the load side (`pipeline.load`).
"""
