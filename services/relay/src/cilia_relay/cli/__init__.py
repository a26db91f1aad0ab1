"""Client commands of ``cilia-relay`` (``observe``): filter building, printing, the RPC loop."""
