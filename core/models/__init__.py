"""Model code: layers, the Llama family, the registry and weight loading."""
