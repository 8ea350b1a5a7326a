"""Hardware descriptions: GPU specs and PCIe topologies."""

__all__: list[str] = []
