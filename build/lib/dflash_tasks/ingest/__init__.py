"""A dataset's prompts into a job: `prompts` reads and normalises the rows of any supported file,
`loader` stores them in the ledger in pipelined chunks. The first stage of a prompt's way."""
