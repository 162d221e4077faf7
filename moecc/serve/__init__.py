"""`moecc serve`: OpenAI's Files and Batches API on this machine, durable across crashes.

One idea per file: `config.py` (the command's options, checked), `auth.py` (API keys and
who owns what), `errors.py` (OpenAI's error shape), `store.py` (SQLite in WAL mode: files,
batches and their state), `blobs.py` (file contents on disk, written atomically),
`uploads.py` (streaming multipart uploads under a size limit), `plans.py` (each model
compiled once for the server's budgets, cached by fingerprint), `batches.py` (a batch's
input split per model, its results merged into output and error files), `runner.py` (the
thread that drives batches through a worker process, one at a time per device),
`worker.py` (that process: `moecc exec`'s runtime, `run_job` with resume), `status.py`
(the status page at `/`), `app.py` (the HTTP routes), `main.py` (start, serve, stop).
"""
