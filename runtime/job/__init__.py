"""The job layer: a JSONL file of requests in (`source` reads it, `requests` parses a line,
`reader` encodes and tracks each request), one result line per request out (`writer`, with
`results` formatting the lines and `integrity` the sidecar checks), the progress display
(`progress`), the output's ownership (`lock`, `paths`), the `moecc exec` driver (`exec`), and
the same job across Ray actors (`distributed`) or inside a Ray Data pipeline (`ray_data`)."""
