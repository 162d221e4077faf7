"""The worker: runs one step plan module by module in plan order (`worker`, which also
dispatches the plan's ops): the step's rows and attention micro-batches (`batch`), the
compute kernels (`kernels`), attention over the paged KV through one interface
(`attention_backends`: the protocol, the registry, the placement; the backends `attention`
on the device and `host_attention` on the host), the step statistics (`stats`) and the
measured timeline of the steps it traces (`timeline`)."""
