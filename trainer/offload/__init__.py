"""mode.offload=disk: a rank's optimizer state (and zero's separate fp32 masters) kept in
a preallocated file between steps, and the optimizer step that reads it back one sharded
buffer at a time. disk.py is the file ([Note: the offload file]), state.py what moves and
the step ([Note: offloaded state]); docs/offload.md has the picture and the figures."""
