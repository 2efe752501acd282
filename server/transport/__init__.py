"""gRPC transport: servicers, the error boundary, authentication and the server process."""
