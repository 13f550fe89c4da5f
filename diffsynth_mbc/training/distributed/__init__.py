"""The process group: the Accelerator and the few collectives the loop needs."""
