"""The job layer: a JSONL file of requests in (`requests`), one result line per request out
(`results`), the progress display (`progress`), the `moecc exec` driver (`exec`), and the
same job across Ray actors (`distributed`) or inside a Ray Data pipeline (`ray_data`)."""
