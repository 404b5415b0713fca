"""Text -> tokens -> batches: corpus, tokenizer, memory-mapped shards and the resumable loader.

Import the submodules directly (`dstrain.data.build`, `dstrain.data.loader`, ...); this package
imports nothing so that `import dstrain.data` stays cheap.
"""
