"""Hardware descriptions: GPU specs and PCIe topologies."""
