//! Reference MIG tables the simulator reproduces (shared/reference/mig-mps.md).
