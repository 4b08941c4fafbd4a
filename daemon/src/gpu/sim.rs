//! Simulated GPUs: a faithful model of NVML. SCAFFOLD: replaced by the gpu work.
