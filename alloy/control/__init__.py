"""Everything that drives Ray from outside: the head process, Serve deploys, node drain, the local runner."""
