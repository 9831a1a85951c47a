"""Training runs through the queue: `manage.py train` -> beat (when the data is ready) -> the
`train` queue -> a training worker -> the quality gate -> a trainer -> checkpoints (S3).

- `runs`: the run's record in Redis and its status changes (compare-and-set);
- `spec`: --config's [gate], [reference] and [command] sections, checked before queueing;
- `launch`: beat's side: queue runs whose trigger holds, queue again runs whose worker died;
- `execute`: one run on the training worker, from queued to its final status;
- `command`: the external trainer's process, its log, its stop;
- `specforge`: the run config SpecForge 0.2.0's `specforge train --config` reads, and its
  chat template for a conversations export (chosen from the job's thinking mode, or refused);
- `checkpoints`: what a trainer wrote, uploaded to S3.

The reference trainer itself is `dflash_tasks.training.reference`; the task is `tasks/train.py`.
"""
