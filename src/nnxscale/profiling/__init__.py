"""Where the time goes: traces of compiled steps, the machine's measured peaks, overlap."""
