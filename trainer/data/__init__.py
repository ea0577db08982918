"""What a run trains on, and the per-rank batches it is cut into.

- datasets.py: synthetic data, MNIST, CIFAR-10, and `GlobalBatchSampler` / `make_loader`, which
  give each rank its disjoint part of a global batch. Start here.
- tokens.py: token files read through `np.memmap`, cut into training windows (`data=token_file`).
- mix.py: several token directories trained on together (`data.mix`), drawn from by weight.
- text.py: text <-> token ids for the tokenizers `scripts/prepare_text.py` knows.
- corpus.py: what `scripts/prepare_text.py` reads and writes: parquet, JSON lines and dataset
  directories streamed by `datasets`, tokenized in worker processes, written as token files
  (llm.c shards) with their document starts (`X.docs.npy`).
"""
