//! MPS control daemons on real GPUs: one `nvidia-cuda-mps-control -d` per lease.
