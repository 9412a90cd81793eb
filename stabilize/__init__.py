"""stabilize: a mixed-precision training stability harness (see docs/ARCHITECTURE.md)."""
