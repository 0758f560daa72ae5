"""The data pipeline, in two rooms around one contract.

`pipeline.prepare` (Ray) writes a dataset; `pipeline.load` streams it into training batches.
They meet only at what both sides share: `format` (manifest, shard layout, fields),
`tokenizer` (loading the dataset's tokenizer) and `remote` (a dataset at a URL); `validate`
re-checks a written dataset against that contract.
"""
