from moecc_runtime.job.requests import *  # noqa: F401,F403  shim, removed by the lead
