"""Plain-torch references, one per kernel, each with its kernel's exact signature."""
