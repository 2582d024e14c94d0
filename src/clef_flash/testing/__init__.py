"""Test-only helpers (a server on a free loopback port). Nothing outside `testing/` imports this package.

Random releases and generated requests are product features: `clef_flash.checkpoint.random_release`
and `clef_flash.request.samples`."""
