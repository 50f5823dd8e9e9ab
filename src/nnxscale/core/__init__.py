"""The core: pytree helpers, Markdown display and memory measured on devices; no sharding."""
