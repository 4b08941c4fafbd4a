//! NVML backend (nvml-wrapper). SCAFFOLD: replaced by the gpu work.
