"""Model families: how each diffusers transformer is built, fed and read (one module per family)."""
