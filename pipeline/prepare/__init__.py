"""The prepare side of the data pipeline: raw text to a tokenizer and WebDataset shards, with Ray.

`job` runs it (plan -> scan -> tokenizer -> encode -> publish); `sources` and `readers` (with
`manpage`) read the inputs; `work` is what one Ray task does, as pure functions; `ray_runner`,
the only module that imports Ray, runs them; `train_tokenizer` trains SentencePiece. What it
writes is `pipeline.format`'s contract; it never imports the load side (`pipeline.load`).
"""
