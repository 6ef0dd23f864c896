"""GPU profile tools, interchangeable with AIBrix's: `profile sweep` measures, `profile build`
turns the measurements into the profile the gateway and the optimizer read."""
