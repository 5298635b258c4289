"""Readers of labelled image datasets in their published on-disk layouts, and an input pipeline.

* `cbcert.datasets.cub`: CUB-200-2011 (200 bird species, 312 binary attributes);
* `cbcert.datasets.rival10`: RIVAL-10 (10 classes, 18 binary attributes);
* `cbcert.datasets.common`: the record type (`Example`), `DatasetError` and `batches`, the
  streaming, deterministically shuffled pipeline from records to numpy batches;
* `cbcert.datasets.synthetic`: tiny synthetic datasets written in the two published layouts.

Pure numpy and PIL on host; nothing here imports jax.
"""
