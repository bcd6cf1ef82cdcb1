"""The transformers adapter: PagedCache, PagedLayer, the step logic, prefix attach/publish, generate."""
