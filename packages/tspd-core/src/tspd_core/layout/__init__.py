"""Layout planner: cache transfer contracts, block manifests, routes and copy descriptors."""
