"""Response caches (local LRU, Redis, plugins). Empty until the response-cache work lands."""
