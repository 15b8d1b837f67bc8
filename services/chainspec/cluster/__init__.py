"""Ray hosting: the controller (membership, health, scaling), the service actors, and the
stack commands (up, status, scale, down) that find a stack from any process."""
