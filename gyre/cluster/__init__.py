"""The live cluster: the controller's gRPC services, the cell and proxy processes, `gyre run`."""
