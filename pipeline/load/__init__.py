"""The load side of the data pipeline: a prepared dataset streamed into token batches for training.

`loader.ShardLoader` is the entry (rank/worker split, seeded shuffle, exact resume); `epoch`
decides which samples make each batch; `shards` reads one tar shard; `collate` turns samples
into the batch. It reads what `pipeline.format` specifies and never imports the prepare side.
"""
