"""The runtime: versions, events, processes (`launch`) and emulated devices."""
