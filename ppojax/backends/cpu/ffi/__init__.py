"""ppojax's C++ handlers for XLA's FFI (CPU): their sources, the header they share, and how they are built."""
