"""Image-text data pipelines: record schemas, readers, images, chat formatting, collation, converters,
synthetic verifiable visual tasks."""
