"""Distribution: moving what the factory built to where it is served.

* ``wheelhouse``  the wheels for an offline install
* ``oci_layout``  OCI basics (media types, descriptors, digests) and the image layout on disk
* ``registry``    a registry repository through oras: auth, private CA, retries, chunked resumable uploads
* ``modelpack``   a signed version as a CNCF ModelPack artifact or a model-car image, and its referrers
* ``push_pull``   push with signature/provenance/BOM/release referrers; pull verified before it lands
* ``bom``         the CycloneDX 1.7 bill of materials, written into the version folder before signing
"""
