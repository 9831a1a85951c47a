"""A finished row's way out: `rows` builds it, `batches` seals rows into checksummed batches,
`storage` writes them (a directory or S3), `progress` computes progress.json, `export` downloads
and verifies a job's dataset, `stats` answers "are we hitting the cap?"."""
