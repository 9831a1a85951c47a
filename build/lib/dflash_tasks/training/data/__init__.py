"""Training data the drafter can use as it is: exact tokens and loss masks, the quality gate,
SpecForge-ready export, and the rows a job shipped read back newest-first.

- `tokens`: a row's `input_ids` and `loss_mask`, from the server's own token ids or, failing
  those, from the target tokenizer's chat template (the two agree on the same row);
- `gate`: the rules a training row must pass and the figures `manage.py validate` reports;
- `reader`: a job's rows through its manifest (local directory or S3), newest copy per id;
- `exports`: `manage.py export --format specforge-conversations|specforge-tokenized|parquet`;
- `monitor`: beat's sample of fresh rows, whose figures go into progress.json as `quality`.

The streaming torch dataset is `dflash_tasks.training.torch_dataset`. docs/TRAINING_DATA.md explains it all.
"""
