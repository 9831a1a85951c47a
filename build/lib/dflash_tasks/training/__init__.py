"""The last stage: the shipped rows as training data. `data` (exact tokens, the quality gate,
SpecForge exports, a job's rows read back), `torch_dataset` (a streaming torch dataset over
them), `queue` (training runs launched by beat onto the train queue) and `reference` (a readable
DFlash trainer)."""
