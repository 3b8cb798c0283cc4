"""The systems Occult is compared with. Each implements :class:`occult.ep.Dispatcher`;
third-party libraries are imported lazily inside the methods that need them."""
