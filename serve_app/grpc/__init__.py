"""The gRPC surface: baton.v1.Baton's translations to and from engine types (service.py),
how Serve's gRPC ingress registers and decodes its services (servicer.py), the standard
health service (health.py), server reflection v1 beside Serve's v1alpha (reflection.py),
and the generated stubs (api/)."""
