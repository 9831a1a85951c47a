"""What every stage shares and nothing else: settings (the only reader of DFLASH_*), every Redis
key and queue name, a job's record and its lifecycle, the process's Redis connection and the
per-job locks. Imports no other stage."""
