"""The worker: runs one step plan module by module in plan order (`worker`, which also
dispatches the plan's ops): the step's rows and attention micro-batches (`batch`), the
compute kernels (`kernels`), attention over the paged KV (`attention`, the attention
backend), the step statistics (`stats`) and the measured timeline of the steps it traces
(`timeline`)."""
