"""GPU tests run in-process services with the loopback transport unless they start their own."""
