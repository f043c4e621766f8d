"""Everything that depends on the host CPU: what it can run (`capabilities`), chosen once, before JAX starts."""
