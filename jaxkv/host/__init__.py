"""The host side of the KV cache: pinned memory (`memory`), and decode attention on the host CPU over the rows it
holds (`decode`: the split layers' path; `calls`: their jitted device calls; `attention`: the kernel; `split`: the
host's share; `wait`: the C++ ops by which the devices wait for the host)."""
