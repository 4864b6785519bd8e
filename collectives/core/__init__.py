"""The infrastructure every lesson stands on: launching worlds, tracing, timing, the cost
model, registered memory, and the simulated cluster of several machines on one host."""
